"""The engine's loop: `LLMEngine` (one step: schedule, propose, one target pass, verify,
book the results), `AsyncEngine` (that loop on a thread of its own, fed by asyncio callers),
the continuous-batching `Scheduler`, the per-request record and the outputs and statistics a
step hands back. Everything else in `engine/` is called from here."""
