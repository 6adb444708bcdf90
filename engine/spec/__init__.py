"""Speculation: proposers, draft-length policies, the cost model, the verifier, the planner."""
