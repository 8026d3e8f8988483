"""The `fedal` command: the application's top. It assembles the subcommands of the core
(`simulate`) and of the runtimes (`demo`, `coordinator`, `agent`, `export`, `fleet`, `hil`);
nothing below it imports it, and the core never names the runtimes."""
