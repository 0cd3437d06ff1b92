"""Device-pool leases (layer 1; pure): the rules of a pool of devices shared by several jobs -- one lease per holder,
all or nothing, FIFO without overtaking on a shared device, expiry, renewal while uncontended -- as a lease book
driven by an explicit clock, so it is tested alone.  It imports only core; the pool service and its clients
(cluster/device_pool.py) import it."""
