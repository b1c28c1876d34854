"""The turn: one request on a session, from its route to the engine and back."""
