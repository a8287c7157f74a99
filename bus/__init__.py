"""Everything that touches NATS: server, connection, topology, publish, consume, trace."""
