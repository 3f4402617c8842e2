"""The local backend's boundary: what keeps a command in, and what it may use.

- :mod:`.bwrap`: bubblewrap's probe and the ``"boundary"`` / ``"host"`` profiles (namespaces);
- :mod:`.landlock`: Landlock mode's ruleset and the helper each command restricts itself with
  (a boundary without namespaces or privilege);
- :mod:`.seccomp`: the boundary's seccomp filter (what a command may not call), for both;
- :mod:`.egress_policy`: :class:`EgressPolicy`, the hosts a command may reach;
- :mod:`.egress_proxy`: the proxy that enforces it, outside the sandbox, and its forwarder inside;
- :mod:`.egress_request`: the proxy's strict reading of a request head;
- :mod:`.cgroups`: a cgroup per sandbox (memory and processes for the whole sandbox);
- :mod:`.limits`: :class:`Limits`, and their enforcement outside the cgroup (``prlimit``, the
  workdir's tmpfs).

Each module stands on its own (none imports the local backend above it): :mod:`.landlock`, the
boundary where bubblewrap cannot create namespaces, sits beside :mod:`.bwrap`.
"""
