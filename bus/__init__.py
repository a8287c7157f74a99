"""Everything that touches NATS, and the process runtime every worker runs on: the server,
connection, topology (channels, KV keys), publish, the readers of each read mode, dead
letters, tracing, per-role permissions (`security`), attaching a worker to a run (`runtime`),
membership, one stage shape (`stage`) and the named crash points. It knows no stage."""
