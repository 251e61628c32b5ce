"""Draft vocabularies that follow the traffic (EvoSpec): ARC buffer, co-occurrence graph, HNSW
retrieval over the LM head, and the ``DynamicVocab`` that ties them to a drafter."""
