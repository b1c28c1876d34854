"""OpenAI-compatible multi-tenant gateway and the `slotkeeper` command line."""
