"""The local backend's boundary: what keeps a command in, and what it may use.

- :mod:`.bwrap`: bubblewrap's probe and the ``"boundary"`` / ``"host"`` profiles (namespaces);
- :mod:`.landlock`: Landlock mode's ruleset and the helper each command restricts itself with
  (a boundary without namespaces or privilege);
- :mod:`.seccomp`: the boundary's seccomp filter (what a command may not call), for both;
- :mod:`.egress_proxy`: the proxy that enforces the egress allowlist
  (:mod:`cancellable_agents.toolsets.sandbox.egress_policy`), outside the sandbox, and its
  forwarder inside;
- :mod:`.egress_request`: the proxy's strict reading of a request head;
- :mod:`.cgroups`: a cgroup per sandbox (memory and processes for the whole sandbox);
- :mod:`.quotas`: the enforcement of :class:`~cancellable_agents.toolsets.sandbox.limits.Limits`
  outside the cgroup (``prlimit``, the workdir's tmpfs).

The policies themselves (the egress allowlist, the limits) are not the local backend's: they live
one floor up, for any backend.

Each module stands on its own (none imports the local backend above it): :mod:`.landlock`, the
boundary where bubblewrap cannot create namespaces, sits beside :mod:`.bwrap`.
"""
