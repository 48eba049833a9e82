"""Code shared by every runtime role: errors, tensor encoding, messages, typed config."""
