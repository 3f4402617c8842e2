"""The local backend's boundary: what keeps a command in, and what it may use.

- [`bwrap`][cancellable_agents.toolsets.sandbox.local.boundary._bwrap]: bubblewrap's probe and the
  ``"boundary"`` / ``"host"`` profiles (namespaces);
- [`landlock`][cancellable_agents.toolsets.sandbox.local.boundary._landlock]: Landlock mode's ruleset
  and the helper each command restricts itself with (a boundary without namespaces or privilege);
- [`seccomp`][cancellable_agents.toolsets.sandbox.local.boundary._seccomp]: the boundary's seccomp
  filter (what a command may not call), for both;
- [`egress_proxy`][cancellable_agents.toolsets.sandbox.local.boundary._egress_proxy]: the proxy that
  enforces the egress allowlist
  ([`egress_policy`][cancellable_agents.toolsets.sandbox.egress_policy]), outside the sandbox, and
  its forwarder inside;
- [`egress_request`][cancellable_agents.toolsets.sandbox.local.boundary._egress_request]: the proxy's
  strict reading of a request head;
- [`cgroups`][cancellable_agents.toolsets.sandbox.local.boundary._cgroups]: a cgroup per sandbox
  (memory and processes for the whole sandbox);
- [`quotas`][cancellable_agents.toolsets.sandbox.local.boundary._quotas]: the enforcement of
  [`Limits`][cancellable_agents.toolsets.sandbox.limits.Limits] outside the cgroup (``prlimit``, the
  workdir's tmpfs).

The policies themselves (the egress allowlist, the limits) are not the local backend's: they live
one floor up, for any backend.

Each module stands on its own (none imports the local backend above it):
[`landlock`][cancellable_agents.toolsets.sandbox.local.boundary._landlock], the boundary where
bubblewrap cannot create namespaces, sits beside
[`bwrap`][cancellable_agents.toolsets.sandbox.local.boundary._bwrap].
"""
