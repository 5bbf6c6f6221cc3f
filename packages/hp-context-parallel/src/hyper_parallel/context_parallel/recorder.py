"""The event recorder, now hp-dtensor's (:mod:`hyper_parallel.dtensor.recorder`): one recorder
for every layer's collectives. Re-exported here so that existing imports keep working."""

from hyper_parallel.dtensor.recorder import Event, EventRecorder, current_recorder, record_events

__all__ = ["Event", "EventRecorder", "current_recorder", "record_events"]
