"""Pure policy of the fully-async trainer: no Ray, no asyncio, no HTTP, no files.

Protocol messages, the staleness budget and training-time check, the sample ledger's state machine and batch
assembly. The runtime (Ray/asyncio shells), the simulator and the tests call the same code here.
"""
