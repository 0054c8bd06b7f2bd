"""``herd plan -f FILE.yaml``: print the objects the operator would create, as ``helm template`` does.

No cluster is read or written: each ModelDeployment of the file goes through the operator's own pure
planner (``herd.operator.plan``) with the operator's settings (the same flags as ``herd operator``),
and every child is printed as a YAML document. What only the API server can add is left out: the
owner reference to the ModelDeployment (its uid exists once it is applied), server defaults and status.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import yaml

from herd.api.crd import KIND, ModelDeployment
from herd.api.manifest import ManifestError, load_manifest
from herd.cli.crds import NoAliasDumper
from herd.cli.operator import add_plan_arguments, plan_settings
from herd.operator.plan import plan
from herd.operator.settings import PlanSettings

__all__ = ["register", "render_plan"]


def render_plan(deployments: Sequence[ModelDeployment], settings: PlanSettings) -> str:
    """Every child of every ModelDeployment, one YAML document each, with the labels the operator
    copies from its ModelDeployment (kopf's ``adopt`` leaves a child's own labels as they are)."""
    documents = []
    for md in deployments:
        source = f"# Source: {KIND} {md.metadata.namespace}/{md.metadata.name}\n"
        for child in plan(md, settings).objects:
            labels = child.body["metadata"].setdefault("labels", {})
            for key, value in md.metadata.labels.items():
                labels.setdefault(key, value)
            body = yaml.dump(child.body, Dumper=NoAliasDumper, sort_keys=False, width=120)
            documents.append(f"---\n{source}{body}")
    return "".join(documents)


def run(args: argparse.Namespace) -> int:
    try:
        deployments = load_manifest(args.filename)
    except ManifestError as error:
        print(f"herd plan: {error}", file=sys.stderr)
        return 1
    if args.namespace is not None:
        deployments = [
            md.model_copy(update={"metadata": md.metadata.model_copy(update={"namespace": args.namespace})})
            for md in deployments
        ]
    sys.stdout.write(render_plan(deployments, plan_settings(args)))
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan", help="print the objects the operator would create for a manifest (no cluster needed)"
    )
    parser.add_argument("-f", "--filename", required=True, help="ModelDeployment YAML, as kubectl apply -f")
    parser.add_argument(
        "-n", "--namespace", default=None, help="as kubectl apply -n (default: the manifest's, else default)"
    )
    add_plan_arguments(parser)
    parser.set_defaults(func=run)
