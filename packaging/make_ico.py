"""Render the SVG icon to a multi-size .ico (Windows executable and shortcut icon): Qt draws, Pillow packs."""
import io
import sys

from PIL import Image
from PySide6.QtCore import QBuffer, QByteArray, QIODevice
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer


def main(svg: str, out: str) -> None:
    app = QGuiApplication.instance() or QGuiApplication([])  # noqa: F841  (Qt needs an application)
    renderer = QSvgRenderer(svg)
    if not renderer.isValid():
        raise SystemExit(f"{svg}: not a valid SVG")
    img = QImage(256, 256, QImage.Format_ARGB32)
    img.fill(0)
    painter = QPainter(img)
    renderer.render(painter)
    painter.end()
    buf = QByteArray()
    dev = QBuffer(buf)
    dev.open(QIODevice.WriteOnly)
    img.save(dev, "PNG")
    Image.open(io.BytesIO(bytes(buf))).save(out, sizes=[(s, s) for s in (16, 24, 32, 48, 64, 128, 256)])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
