"""Pure policy of the fully-async trainer: no Ray, no asyncio, no HTTP, no files.

Protocol messages (protocol: trajectories; messages: the trainer <-> rollout service call), sample ids (ids), the
policy version's unit (versions), the staleness budget and training-time check, the group buffer, the sample
ledger's state machine and batch assembly. The runtime (Ray/asyncio shells), the simulator and the tests call
the same code here.
"""
