"""herd.operator: the kopf operator that turns ModelDeployments into worker Deployments and Services.

Pure modules plan (``plan``, ``pod``, ``source``, ``status``, ``conditions``, ``drift``); the rest talk
to the API server (``kube``, ``reconcile``, ``events``) or to kopf (``handlers``, ``runner``).
Run it with ``herd operator`` or ``herd.operator.runner.run_operator``.
"""

__all__: list[str] = []
