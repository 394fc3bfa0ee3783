"""The chat page at / of `ssd serve`: plain HTML, CSS and JavaScript in ssd/serving/page/, no
build step and no library. It speaks the server's own OpenAI route and asks for the extension
field `ssd_speculation` to mark the accepted draft tokens (docs/serving.md, "The page"). The
page itself is public (a browser cannot send a key with it); the routes it calls keep the
server's --api-key, which the page asks for and keeps in the tab."""
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.exceptions import HTTPException

PAGE = Path(__file__).parent / "page"
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
# Scripts and styles from the page's own files only: text a model writes could not run as
# script even if it reached the page as HTML (it is inserted as text: app.js).
HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                      "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def routes() -> APIRouter:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def index():
        return FileResponse(PAGE / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)

    @router.get("/page/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in ASSETS:
            raise HTTPException(404, "no such file of the page")
        return FileResponse(PAGE / name, media_type=ASSETS[name], headers=HEADERS)

    return router
