"""``herd operator``: run the kopf operator that reconciles ModelDeployments."""

from __future__ import annotations

import argparse
import asyncio
import sys

from herd.api.logs import configure_logging
from herd.cli._args import positive
from herd.operator.settings import AutoscalerSettings, OperatorConfig, PlanSettings

__all__ = ["add_plan_arguments", "operator_config", "plan_settings", "register", "run"]


def run(args: argparse.Namespace) -> int:
    # kopf is imported only when the operator runs.
    from herd.kube import CredentialsError, load_connection
    from herd.operator.logs import configure_operator_logs
    from herd.operator.runner import CrdMissingError, run_operator

    try:
        load_connection(args.kubeconfig)
    except CredentialsError as error:
        print(f"herd operator: {error}", file=sys.stderr)
        return 2
    configure_logging("operator", args.log_level)
    configure_operator_logs()
    config = operator_config(args)
    namespaces = [] if args.all_namespaces else args.namespace
    try:
        asyncio.run(
            run_operator(
                config, namespaces=namespaces, standalone=args.standalone, liveness_endpoint=args.liveness
            )
        )
    except CrdMissingError as error:
        print(f"herd operator: {error}", file=sys.stderr)
        return 2
    return 0


def operator_config(args: argparse.Namespace) -> OperatorConfig:
    """The operator's settings from its command line."""
    plan = plan_settings(args)
    autoscaler = AutoscalerSettings(
        interval_s=args.autoscale_interval,
        stabilization_s=args.autoscale_window,
        demand_interval_s=args.demand_interval,
    )
    return OperatorConfig(
        kubeconfig=args.kubeconfig, plan=plan, autoscaler=autoscaler, retry_delay=args.retry_delay
    )


def plan_settings(args: argparse.Namespace) -> PlanSettings:
    """The planner's cluster-level settings from ``add_plan_arguments``' flags."""
    return PlanSettings(
        worker_image=args.worker_image,
        vllm_image=args.vllm_image,
        epp_image=args.epp_image,
        s3_image=args.s3_image,
        token_secret=args.token_secret,
        orchestrator_service=args.orchestrator_service,
        orchestrator_namespace=args.orchestrator_namespace,
    )


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """What the planner needs beyond a ModelDeployment (``herd operator``'s and ``herd plan``'s flags)."""
    defaults = PlanSettings()
    parser.add_argument("--worker-image", default=defaults.worker_image, help="image of pools that name none")
    parser.add_argument(
        "--vllm-image", default=defaults.vllm_image, help="vLLM's image, for vllm pools that name none"
    )
    parser.add_argument(
        "--epp-image",
        default=defaults.epp_image,
        help="image of the endpoint picker of spec.gateway.inferencePool",
    )
    parser.add_argument("--s3-image", default=defaults.s3_image, help="init image that syncs s3:// models")
    parser.add_argument(
        "--orchestrator-service", default=defaults.orchestrator_service, help="for status.endpoint"
    )
    parser.add_argument(
        "--orchestrator-namespace", help="for status.endpoint (default: each ModelDeployment's namespace)"
    )
    parser.add_argument(
        "--token-secret", default=defaults.token_secret, help="Secret with the internal token"
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("operator", help="run the Kubernetes operator (kopf)")
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="serve this namespace (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace")
    parser.add_argument("--standalone", action="store_true", help="no peering with other operator replicas")
    parser.add_argument(
        "--liveness", metavar="URL", help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    add_plan_arguments(parser)
    parser.add_argument(
        "--retry-delay",
        type=positive(float),
        default=OperatorConfig().retry_delay,
        help="seconds before a pass that an API error failed runs again",
    )
    scaling = AutoscalerSettings()
    parser.add_argument(
        "--autoscale-interval",
        type=positive(float),
        default=scaling.interval_s,
        help="seconds between autoscaler rounds (metric scrapes and decisions)",
    )
    parser.add_argument(
        "--autoscale-window",
        type=positive(float),
        default=scaling.stabilization_s,
        help="scale-down stabilization window in seconds",
    )
    parser.add_argument(
        "--demand-interval",
        type=positive(float),
        default=scaling.demand_interval_s,
        help="seconds between reads of the requests the orchestrators hold for pools at zero",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=run)
