"""Small jobs for ``torchrun`` (``hello`` also runs under ``dtlib.spawn``): ``hello`` and ``env`` (what each rank
gets), ``exit_code`` (a failing rank), ``local_rank`` (the old launcher's argument), ``loader`` (data-loading
workers under a ``DistributedSampler``)."""
