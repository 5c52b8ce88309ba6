"""Main jobs built on the library (``shardps train digits``). Their data dependencies
(scikit-learn, tqdm) come with the ``apps`` extra: ``pip install -e ".[apps]"``.
"""
