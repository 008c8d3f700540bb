"""What the tests share: waiting for events (``waiting``), helper processes (``echo_server``), vLLM's availability
(``vllm``). Servers (etcd, nats-server) come from tests/conftest.py's fixtures, on free loopback ports."""
