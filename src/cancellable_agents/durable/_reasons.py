"""Why a durable run did not resume, and why its record stopped being written.

Decided by [`resume_plan`][cancellable_agents.durable._resume_plan] (and, for a record that fails its
checks, by [`cancellable_agents.durable._record_format`][]) and by the
[`Appender`][cancellable_agents.durable._appender.Appender]; read back as ``Journal.fresh_start`` and
``Journal.recording_off`` and in the run's facts, where the metrics tag runs with them. Each value
is a short, fixed word: fit for a metric tag (a bounded set) and for a log line.
"""

from __future__ import annotations

import enum


class FreshStart(str, enum.Enum):
    """Why a try of a ``durable=True`` run started fresh instead of resuming an earlier try."""

    #: The store holds no record: the first try, no earlier try wrote anything, or the run's
    #: last try completed (its record ends there).
    NO_RECORD = "no_record"
    #: A record exists but holds no message yet: the earlier try stopped before its first step.
    NOTHING_RECORDED = "nothing_recorded"
    #: The earlier try was stopped by a user (marked, cleared) and ``resume_after_clear`` is off.
    USER_STOP = "user_stop"
    #: The record failed its checks: edited, reordered, missing an entry, unparsable, another
    #: format (a format-1 record of an older version). A partial or altered transcript is never
    #: fed to the model.
    TAMPERED = "tampered"
    #: The record is another run's: the prompt, system prompt, instructions, model or tools changed.
    FINGERPRINT_CHANGED = "fingerprint_changed"
    #: The store failed while the record was read or taken over; the run goes on without a record.
    STORE_ERROR = "store_error"


class RecordingOff(str, enum.Enum):
    """Why a try stopped writing its continuity record (the run itself went on, or cancelled)."""

    #: A newer try of the same task wrote a record of its own (two copies were running): this
    #: try's appends no longer count (none is part of what the newer try resumes from) and it
    #: cancels itself. Seen at the periodic ownership check.
    FENCED = "fenced"
    #: The record was deleted while the run went on (seen at the periodic ownership check).
    DELETED = "deleted"
    #: A store call failed (read, write, or the ownership check).
    STORE_ERROR = "store_error"
