"""A node agent for tests, in the manner of KWOK and virtual-kubelet: a Ready Node whose pods run as
local processes on this machine (see ``agent`` for the process, docs/kubernetes.md section 11 for
what it does and the liberties it takes)."""
