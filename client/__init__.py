"""tether.client."""
