"""The byte-level tokenizer shared by the engine, the router and the client.

Token ids 0-255 are the bytes of the UTF-8 text; 256 is end-of-sequence. Knows nothing about models.
"""

EOS_TOKEN = 256
VOCAB_SIZE = 257


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    """Text of `tokens`; EOS and bytes that do not form valid UTF-8 (a cut multibyte char) are dropped."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="ignore")


def decode_bytes(tokens: list[int]) -> bytes:
    return bytes(t for t in tokens if t < 256)
