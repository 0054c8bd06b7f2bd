"""Tenants: who an API key belongs to, how urgent its requests are, what it may use and how much.

The keys file (``--api-keys-file``; on Kubernetes the Secret named by the chart's
``orchestrator.apiKeys``) is either the old list (one key per line, every key in the ``default``
tenant) or a YAML document::

    tenants:
      - name: search
        keys: [sk-search-1, sk-search-2]
        priority: 0            # 0 is served first; larger numbers wait behind smaller ones
        weight: 2              # its share, against the other tenants of its priority, when backlogged
        models: [llama-3-8b]   # the models it may call (omitted: all)
        quotas: {requestsPerMinute: 600, tokensPerMinute: 200000}

A request may lower its own priority (a larger number, by vLLM's ``priority`` field or the
``X-Herd-Priority`` header), never raise it above its tenant's: ``effective_priority``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from herd.api.errors import HttpError

__all__ = [
    "ANONYMOUS",
    "BATCH_PRIORITY",
    "DEFAULT_TENANT",
    "LOWEST_PRIORITY",
    "PRIORITY_HEADER",
    "Quotas",
    "Tenant",
    "TenantSpec",
    "TenantsFile",
    "effective_priority",
    "parse_tenants",
]

LOWEST_PRIORITY = 1000
"""The largest priority number: a request asking for more is held at this one."""
BATCH_PRIORITY = LOWEST_PRIORITY
"""Batch API work runs here, behind every interactive request."""
PRIORITY_HEADER = "x-herd-priority"
_NAME = re.compile(r"[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?")
_YAML_SUFFIXES = (".yaml", ".yml", ".json")
_YAML_OPENING = re.compile(r"---(\s|$)|[\[{]|-(\s|$)|[^\s#:][^:]*:(\s|$)")
"""How a YAML document's first line opens: a marker, a flow collection, a list item, a mapping key."""


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class Quotas(_Config):
    """Per-minute limits of one tenant, across every gateway replica; ``None`` is no limit."""

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    """Prompt plus output tokens, counted from each answer's usage."""


class Tenant(_Config):
    """A tenant as the gateway sees it (its keys are not part of it, so it can be logged)."""

    name: str
    priority: int = Field(default=0, ge=0, le=LOWEST_PRIORITY)
    weight: float = Field(default=1.0, gt=0.0, le=1000.0)
    models: tuple[str, ...] | None = None
    quotas: Quotas = Field(default_factory=Quotas)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError(f"tenant names are 1-64 of a-z, 0-9, '.', '_', '-' (got {value!r})")
        return value

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    def check_model(self, model: str) -> None:
        """403 when the tenant may not call ``model``."""
        if not self.may_use(model):
            raise HttpError(
                403,
                f"tenant {self.name!r} may not use model {model!r}; it may use {', '.join(self.models or ())}",
                param="model",
            )


class TenantSpec(Tenant):
    """A tenant with its keys, as the keys file lists it."""

    keys: tuple[SecretStr, ...] = Field(min_length=1)

    @field_validator("keys")
    @classmethod
    def _strip_keys(cls, keys: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        # Stripped before the file's checks see them, as the plain list and the Authorization header
        # are: " k" is the key "k", a duplicate of "k", and " " an empty key.
        return tuple(SecretStr(key.get_secret_value().strip()) for key in keys)


class TenantsFile(_Config):
    tenants: tuple[TenantSpec, ...] = Field(min_length=1)

    @field_validator("tenants")
    @classmethod
    def _check_unique(cls, tenants: tuple[TenantSpec, ...]) -> tuple[TenantSpec, ...]:
        names = [tenant.name for tenant in tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        keys = [key.get_secret_value() for tenant in tenants for key in tenant.keys]
        if not all(keys):
            raise ValueError("API keys must not be empty")
        if len(set(keys)) != len(keys):
            raise ValueError("an API key may appear once, in one tenant only")
        return tenants


DEFAULT_TENANT = Tenant(name="default")
"""Every key of a plain keys file (one key per line) belongs to it."""
ANONYMOUS = Tenant(name="anonymous")
"""Every request's tenant when authentication is off."""


def parse_tenants(text: str, *, source: str) -> list[tuple[str, Tenant]] | None:
    """``(key, tenant)`` pairs of a YAML tenants document; ``None`` when ``text`` is the plain list of
    keys. ``ValueError`` names ``source`` and what is wrong: an invalid field, YAML that does not
    parse although the file is meant as YAML (``_is_meant_as_yaml``), a YAML mapping or list that is
    no tenants document, or nesting too deep to parse."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        if not _is_meant_as_yaml(text, source):
            return None  # a plain list whose keys YAML cannot read, e.g. one starting with '@'
        raise ValueError(
            f"{source}: not valid YAML: {_yaml_problem(error)}; fix the tenants document "
            "(see docs/admission.md) or list one key per line"
        ) from None
    except RecursionError:
        raise ValueError(
            f"{source}: nested too deeply to parse; a tenants document is a few levels deep "
            "(see docs/admission.md)"
        ) from None
    if isinstance(document, Mapping) and "tenants" in document:
        return _validated(document, source)
    if isinstance(document, Mapping | list):
        # A plain list never parses as a mapping or a list: this is a tenants document gone wrong.
        kind = "mapping" if isinstance(document, Mapping) else "list"
        raise ValueError(
            f"{source}: a YAML {kind} without a top-level `tenants:`; a tenants "
            "document is a mapping whose `tenants:` lists them (see docs/admission.md), a plain "
            "keys file has one key per line"
        )
    return None


def _validated(document: object, source: str) -> list[tuple[str, Tenant]]:
    try:
        parsed = TenantsFile.model_validate(document)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{source}: {where}: {first['msg']}; see docs/admission.md") from None
    return list(_pairs(parsed.tenants))


def _is_meant_as_yaml(text: str, source: str) -> bool:
    """Whether a file that YAML cannot parse was meant as a tenants document rather than the plain
    list: its name ends ``.yaml``, ``.yml`` or ``.json``, or its first line that is neither blank nor
    a comment opens as YAML does (a document marker, a flow collection, a list item, a mapping key),
    as a plain key does not (a key holds no ``": "``, does not end in ``:`` and does not open with
    ``[``, ``{`` or ``- ``)."""
    if source.lower().endswith(_YAML_SUFFIXES):
        return True
    lines = (line.strip() for line in text.splitlines())
    first = next((line for line in lines if line and not line.startswith("#")), "")
    return _YAML_OPENING.match(first) is not None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """The parser's complaint and where, without the excerpt of the line that ``str(error)`` quotes:
    a keys file's lines are secrets, and the message goes to the terminal and the logs."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return " ".join(str(error).split())  # a ReaderError: a character code and an offset
    parts = [
        f"{text} (line {mark.line + 1}, column {mark.column + 1})" if mark else text
        for text, mark in ((error.context, error.context_mark), (error.problem, error.problem_mark))
        if text
    ]
    return ": ".join(parts) or type(error).__name__


def _pairs(specs: Iterable[TenantSpec]) -> Iterable[tuple[str, Tenant]]:
    for spec in specs:
        tenant = Tenant.model_validate(spec.model_dump(exclude={"keys"}))
        for key in spec.keys:
            yield key.get_secret_value(), tenant


def effective_priority(tenant: Tenant, requested: int | None, header: str | None) -> int:
    """The request's priority: its tenant's, or a lower one (a larger number) that the request asked
    for in its body (``requested``) or ``X-Herd-Priority``; never more urgent than its tenant's."""
    asked = [tenant.priority]
    if requested is not None:
        asked.append(requested)
    if header is not None:
        try:
            asked.append(int(header.strip()))
        except ValueError:
            raise HttpError(
                400, f"{PRIORITY_HEADER} must be an integer (larger is less urgent), got {header!r:.40}"
            ) from None
    return min(max(asked), LOWEST_PRIORITY)
