"""How the planner sets a pool's size: ``base`` (the ``Connector`` protocol and its errors) and one module per
``--environment``: ``virtual`` (etcd keys an outside system answers), ``local`` (the circus arbiter of a ``kvmesh
serve`` deployment) and ``kubernetes`` (the scale of a cluster's worker Deployments). Nothing is imported here: each
connector pulls in only what it needs."""
