"""Tasks mwloop ships, written against the public `mwloop.Task` API like a user's own."""
