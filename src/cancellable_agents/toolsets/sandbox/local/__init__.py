"""The local backend: :class:`~cancellable_agents.toolsets.sandbox.local.sandbox.LocalSandbox`,
commands run as process trees on this host that a cancel really stops.

- :mod:`.sandbox`: :class:`LocalSandbox`, a workdir and a command runner (the :class:`Sandbox`
  protocol: set-up, start, stop, destroy);
- :mod:`.provision`: what it makes at creation to hold its commands in (the boundary profile, the
  private tmp, the totals the kernel keeps);
- :mod:`.results`: its ``wait``, ``run`` and ``arun``;
- :mod:`.command`: one command's process tree: watched, stopped whole, reaped, recorded;
- :mod:`.spawn`: the spawning thread and the pipes' readers;
- :mod:`.isolation`: which isolation mode a local sandbox gets here;
- :mod:`.workdirs`: workdirs, and those a SIGKILLed task left behind;
- :mod:`.files`: the file tools' race-free access to the workdir (no symlink followed), and the
  sandbox's file tools on it;
- :mod:`.env`: the environment commands get (an allowlist);
- :mod:`.totals`: the sandbox's own count of its totals where no cgroup or tmpfs keeps them;
- :mod:`.boundary`: what keeps a command in (namespaces, seccomp, egress, cgroups, limits).
"""
