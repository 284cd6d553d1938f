"""Encoder-cache (EC) connectors: encoder outputs shared between instances, so an image one
instance encoded is loaded, not encoded again, by the others."""
