"""The gateway: HTTP for agent code and RL frameworks, OpenAI- and SGLang-shaped, over the router."""
