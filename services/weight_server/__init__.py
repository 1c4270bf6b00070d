"""The weight server: model weights per version in shared memory, mapped by workers without a copy."""
