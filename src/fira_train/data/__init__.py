"""Pre-training data: what to train on (:mod:`.spec`), documents (:mod:`.documents`), tokenizers
(:mod:`.tokenizer`), batch streams (:mod:`.streams`), corpora (:mod:`.corpus`, C4 in
:mod:`.streaming`), built and cached by :func:`fira_train.data.build.build_corpus`."""
