"""Names every process agrees on: the endpoints a worker serves and the event-plane topics it publishes.

Shared by workers and their consumers (frontend, router, planner, rescheduler). Imports nothing.
"""

ENDPOINT_GENERATE = "generate"  # body: GenerateRequest.to_dict(); stream: TokenChunk.to_dict() items
ENDPOINT_KV_STATE = "kv_state"  # body: {}; stream: one KvStateSnapshot.to_dict()
TOPIC_LOAD_METRICS = "load_metrics"  # payload: LoadSnapshot.to_dict(); source id: the worker's instance id
TOPIC_KV_EVENTS = "kv_events"  # payload: [KvEvent.to_dict(), ...] in event-id order; source id: the instance id
