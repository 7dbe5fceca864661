"""The desktop GUI (customtkinter). The only package that imports tkinter; no training logic."""
