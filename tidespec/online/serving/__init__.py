"""The online loop's part that runs inside the serving process: wiring capture into the engine
(``attach``), swapping published versions and adapters in between steps (``adapters``, ``poller``),
judging a swap on served outcomes (``rollback``), and starting, supervising and yielding the trainer
child (``launch``, ``supervisor``, ``governor``). It never imports the trainer's code."""
