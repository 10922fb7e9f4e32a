from proxima.cli.main import app

app()
