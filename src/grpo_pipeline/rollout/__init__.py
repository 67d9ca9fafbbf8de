"""The runtime's generation: turns, the decode loop, the policy's sampling copy, vLLM."""
