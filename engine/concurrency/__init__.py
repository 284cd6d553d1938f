"""The concurrency toolkit: small structured-concurrency pieces the layers above share."""
