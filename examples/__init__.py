"""Example tasks written only against mwloop's public Task API."""
