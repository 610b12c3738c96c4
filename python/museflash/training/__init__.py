"""How the demo pairs under demo/ were trained: the target (train_demo), its DFlash drafter
(train_demo_drafter) and its DFlash2 drafter (train_demo_dflash2). The exporter never imports
this package; the //:train_demo* commands and the demo figures do."""
