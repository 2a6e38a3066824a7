"""The step batch contract: `DataProto` (verl's envelope: `batch`, `non_tensor_batch`, `meta_info`), its array
helpers (`arrays`), and the one table of batch keys with their shapes and meanings (`keys`: two masks, two
meanings: `response_attention_mask` says which tokens exist, `loss_mask` which are trained).
"""
