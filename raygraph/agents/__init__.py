"""Multi-turn agent RL: tools the model calls, their parsing and execution, and sandboxes."""
