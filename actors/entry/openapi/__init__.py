"""The OpenAPI 3.1 document served at `/openapi.json`: the schema pieces every API shares and the document that
assembles each API's request schemas with the routes and their answers."""
