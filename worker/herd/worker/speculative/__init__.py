"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), verification by
rejection sampling, and the adaptive policy that sizes the proposals of each step."""
