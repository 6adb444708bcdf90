"""The engine's loop: `LLMEngine`, `AsyncEngine`, the `Scheduler` and a step's outputs."""
