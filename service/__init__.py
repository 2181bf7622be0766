"""HTTP service in front of the tuning database: cluster nodes look up the best kernel
configs for their GPU and shapes, tuners submit measurements. Build it with
`service.app.create_app`; run it with `cce serve`."""
