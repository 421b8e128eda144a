"""engine_integration: users of hicache (the embedded decoding engine, serving-engine adapters)."""
