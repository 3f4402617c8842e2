"""The local backend:
[`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox], commands run as
process trees on this host that a cancel really stops.

- [`sandbox`][cancellable_agents.toolsets.sandbox.local._sandbox]:
  [`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox], a workdir and a
  command runner (the [`Sandbox`][cancellable_agents.toolsets.sandbox.protocol.Sandbox] protocol:
  set-up, start, stop, destroy);
- [`provision`][cancellable_agents.toolsets.sandbox.local._provision]: what it makes at creation to
  hold its commands in (the boundary profile, the private tmp, the totals the kernel keeps);
- [`results`][cancellable_agents.toolsets.sandbox.local._results]: its ``wait``, ``run`` and
  ``arun``;
- [`command`][cancellable_agents.toolsets.sandbox.local._command]: one command's process tree:
  watched, stopped whole, reaped, recorded;
- [`spawn`][cancellable_agents.toolsets.sandbox.local._spawn]: the spawning thread and the pipes'
  readers;
- [`isolation`][cancellable_agents.toolsets.sandbox.local._isolation]: which isolation mode a local
  sandbox gets here;
- [`workdirs`][cancellable_agents.toolsets.sandbox.local._workdirs]: workdirs, and those a SIGKILLed
  task left behind;
- [`files`][cancellable_agents.toolsets.sandbox.local._files]: the file tools' race-free access to
  the workdir (no symlink followed), and the sandbox's file tools on it;
- [`env`][cancellable_agents.toolsets.sandbox.local._env]: the environment commands get (an
  allowlist);
- [`totals`][cancellable_agents.toolsets.sandbox.local._totals]: the sandbox's own count of its
  totals where no cgroup or tmpfs keeps them;
- [`boundary`][cancellable_agents.toolsets.sandbox.local.boundary]: what keeps a command in
  (namespaces, seccomp, egress, cgroups, limits).
"""
