"""Names every process agrees on: the endpoints a worker serves and the event-plane topics it publishes.

Shared by workers and their consumers (frontend, router, planner, rescheduler). Imports nothing.
"""

ENDPOINT_GENERATE = "generate"  # body: GenerateRequest.to_dict(); stream: TokenChunk.to_dict() items
ENDPOINT_KV_STATE = "kv_state"  # body: {}; stream: one KvStateSnapshot.to_dict()
TOPIC_LOAD_METRICS = "load_metrics"  # payload: LoadSnapshot.to_dict(); source id: the worker's instance id
TOPIC_KV_EVENTS = "kv_events"  # payload: [KvEvent.to_dict(), ...] in event-id order; source id: the instance id
# Disaggregated serving: a prefill worker delivers a RemotePrefillResult.to_dict() to the decode worker it names;
# the stream's one item is {"accepted": bool} (False: that request no longer waits there; the result is dropped).
ENDPOINT_PREFILL_RESULT = "prefill_result"
# payload: PrefillQueueReport.to_dict(); source id: the prefill worker's instance id
TOPIC_PREFILL_QUEUE = "prefill_queue"
# Migration (components/protocol/migration.py): served by every worker that can move requests, same instance id.
ENDPOINT_MIGRATE = "migrate"  # body: MigrateRequest.to_dict(); stream: one MigrationReport.to_dict() per request
ENDPOINT_MIGRATE_IN = "migrate_in"  # body: MigrateInMessage.to_dict(); stream: one MigrateInReply.to_dict()
ENDPOINT_ABORT = "abort"  # body: AbortRequest.to_dict(); stream: one AbortReply.to_dict()
# payload: WorkerStatus.to_dict(); source id: the worker's instance id (it stopped taking new requests)
TOPIC_WORKER_STATUS = "worker_status"
# payload: MigrationCountersReport.to_dict(); source id: the worker's instance id (its migration counters, cumulative)
TOPIC_MIGRATION_COUNTERS = "migration_counters"
# payload: RequestStatsReport.to_dict(); source id: the frontend's (each frontend replica reports its own requests)
TOPIC_REQUEST_STATS = "request_stats"
# Hot-prefix replication (components/protocol/replication.py): served by workers whose engine can import KV with no
# request (simulated engines) or pull it over a KV connector (vLLM; without one it refuses).
# body: ImportPrefixRequest.to_dict(); stream: one ImportPrefixReply.to_dict()
ENDPOINT_IMPORT_PREFIX = "import_prefix"
# The drop of a cold replica, served beside import_prefix. body: DropPrefixRequest.to_dict(); stream: one
# DropPrefixReply.to_dict()
ENDPOINT_DROP_PREFIX = "drop_prefix"
# The source side of a pulled copy (vLLM workers): keep a cached prefix's blocks for the destination's pull and say
# which tokens they hold. body: ExportPrefixRequest.to_dict(); stream: one ExportPrefixReply.to_dict()
ENDPOINT_EXPORT_PREFIX = "export_prefix"
