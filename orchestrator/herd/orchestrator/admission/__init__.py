"""The admission layer in front of routing: tenants, priorities, fair queues, quotas (docs/admission.md)."""
