"""The OpenAI-compatible frontend (aiohttp): models discovered from the workers' registrations, tokenisation and chat
templates, routing through ``components.router``, streaming back over the runtime. The only package in kvmesh that
speaks HTTP status codes (``app.py``).
"""

from components.frontend.config import FrontendConfig
from components.frontend.server import Frontend

__all__ = ["Frontend", "FrontendConfig"]
