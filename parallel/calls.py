"""The Ray concurrency groups a rank's calls run on besides the data path (Ray's default
group). Light on purpose: the actor class that instance handles are made of
(:mod:`pdserve.cluster.instance_actor`) names them, and every process that holds a
handle imports that class."""

HEALTH = "health"  # ping and health, which never touch the engine loop
CONTROL = "control"  # short control calls that go through the engine loop
