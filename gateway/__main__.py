from gateway.cli import main

if __name__ == "__main__":          # not when a `serve --workers` worker (spawned) imports it
    main()
