"""The dispatcher: client sessions, serving, handlers, ownership, bridging, listens, consent."""
