"""How the planner sets a pool's size: ``base`` (the ``Connector`` protocol and its errors) and one module per
``--environment``: ``virtual`` (etcd keys an outside system answers) and ``local`` (the circus arbiter of a ``kvmesh
serve`` deployment). ``kubernetes`` is not implemented yet. Nothing is imported here: each connector pulls in only
what it needs."""
